"""The operator's tools over a spool: spoolctl, inspection, verify, salvage, the start plan."""
