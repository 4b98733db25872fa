"""Tensor-parallel building blocks shared by the model definitions."""
