"""The copy-engine path: pages moved by the GPU's DMA engines in one batched driver call.

The byte runs it copies, the batched call, and the measured table that picks it under
``path="auto"``.
"""
