"""What the gateway keeps for offline work: files, batch objects, and the RQ queue batch jobs wait in."""
