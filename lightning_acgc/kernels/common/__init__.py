"""Helpers shared by the codec kernel families: bit packing, NaN/inf exceptions, group
views, the backend router and (imported only by the Triton modules) Triton utilities."""
