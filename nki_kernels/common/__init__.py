"""Building blocks shared by the kernel families (NKI 0.7 helpers called from inside kernels)."""
