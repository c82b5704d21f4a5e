"""nxdtrain's training-tag format (format 2): a tag's optimizer state by parameter name, layout-neutral, how it rides
a conversion plan, which dp rank's file holds which state (ZeRO-1, ep), and a bf16 run's fp32 masters as weights."""
