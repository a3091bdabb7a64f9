"""Partition arithmetic and the flat buffers every stage is built from.

- layout.py — where each parameter, bucket and rank slice sits in a flat buffer (alignment,
  padding, bucket sizes);
- flat_buffer.py — :class:`FlatBuffer`: a 1-D tensor laid out by a layout, with views;
- buffer_pool.py — reused communication buffers of one constant size (ZeRO-R).
"""
