"""Peer kernels run side by side with ours: AWS's nki-library from a checkout named by NKILIB_SRC."""
