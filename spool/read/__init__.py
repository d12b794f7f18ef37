"""Reading the log: the one reader, the classification of its anomalies, lost-message naming, listings."""
