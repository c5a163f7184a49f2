"""Process groups (rank lists, coordinators, state) and DP transitions."""
