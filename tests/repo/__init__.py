"""Checks on the repository itself (its source and docs), not on the daemon's behaviour."""
