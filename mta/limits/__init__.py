"""Rate limits per client address, per authenticated user and per sender, shared by the relay's processes."""
