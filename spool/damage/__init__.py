"""What the engine does with damage the reader found: the policy and the quarantine."""
