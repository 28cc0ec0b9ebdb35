"""Custom ops (``ops.py``: schema, reference, fake) and their device kernels (``triton/``, ``nki/``)."""
