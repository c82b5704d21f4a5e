"""nxdtrain's training-tag format (format 2): a tag's optimizer state by parameter name, layout-neutral, how it rides
a conversion plan, and which dp rank's file holds which parameter's state (ZeRO-1, expert parallelism)."""
