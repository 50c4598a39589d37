"""The copy-engine path: a plan's pages moved by the GPU's DMA engines in one batched driver
call, the byte runs it copies, and the measured table that picks it under ``path="auto"``."""
