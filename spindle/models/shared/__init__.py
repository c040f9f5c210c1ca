"""Code the family folders share (no family names here): pipeline-backed condition models and stages,
latent statistics, tiny-checkpoint parts."""
