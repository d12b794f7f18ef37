"""Writing the log: the log writer, the room ahead of it, message bodies, the disk reserve, fresh envelopes."""
