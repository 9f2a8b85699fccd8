"""Tensor math that holds no state and knows no model: attention with exact merges, RoPE, row writes."""
