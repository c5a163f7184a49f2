"""Torch layer of the toolkit: configs, process groups, dp transitions, sharded layers and loading."""
