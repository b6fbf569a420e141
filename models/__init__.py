"""Catalog data: HF config.json files of real MoE models and accelerator profiles (YAML)."""
