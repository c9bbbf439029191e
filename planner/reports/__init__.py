"""What tessera prints about costs and runs: the cost table, the run report, predicted vs measured."""
