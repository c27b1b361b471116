"""Pure torch math for rlrun: advantages, losses, KL, aggregation. Imports nothing from the project."""
