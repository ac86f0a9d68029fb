"""Kernels written in Triton's Gluon dialect (explicit layouts, warp specialisation)."""
