"""Cache policies: one file each."""
