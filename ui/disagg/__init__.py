"""The views of a disaggregated deployment: both pools side by side, the transfer strip and
per-engine charts."""
