"""The trio layer: AsyncSpool, group commit, async claims and admin changes, the checkpointer."""
