"""Building a job's model: shape it on the meta device, materialize it, load its starting weights, export it."""
