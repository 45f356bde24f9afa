"""When something goes wrong: one report per failure, the step watchdog, the run lock, error lines."""
