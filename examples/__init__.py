"""Example models and scripts for tessera."""
