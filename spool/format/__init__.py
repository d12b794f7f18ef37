"""The on-disk format: positions, framed records and their payloads, the segment header, the checkpoint file."""
