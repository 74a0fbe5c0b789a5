"""Deployment helpers: replicas of the server behind an off-the-shelf router (`hybridserve replicas`)."""
