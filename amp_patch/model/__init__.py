"""What initialize does to a model: parameter and buffer casts, input/output casting hooks."""
