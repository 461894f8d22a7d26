"""Recipes of lightning_acgc: ResNet, BERT and GNN training driven by the Hydra configs in
``configs/``.

- ``python recipes/train.py [overrides]``: train one recipe (:func:`recipes.train.train`).
- ``python -m recipes.compare``: plain vs compressed training side by side.
"""
