"""Runnable training examples: ``python -m scaledoptim.examples.demo --compare``.

A character-level transformer on the Python standard library's own source, and a small CNN on
synthetic images, trained in fp32, with ``torch.amp`` and with scaledoptim, side by side.
"""
