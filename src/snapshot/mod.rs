//! PyTorch memory snapshots (placeholder until written).
