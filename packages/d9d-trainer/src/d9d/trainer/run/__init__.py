"""The run loop and its cadences: steps, evaluation, checkpoints and resume, early stopping, signals."""
