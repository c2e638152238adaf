"""DFlash drafter training."""
