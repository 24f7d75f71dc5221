"""studies/serving."""
