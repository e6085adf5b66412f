"""What carries decisions out: the executor, reconcile after a restart, the drain-ticket hook."""
