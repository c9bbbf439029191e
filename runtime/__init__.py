"""tessera's executor: runs a saved plan under torchrun (arrives with the runtime issue)."""
