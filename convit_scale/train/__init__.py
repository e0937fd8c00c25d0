"""The training loop, schedules, optimizer groups, checkpoints and distributed start-up."""
