"""Recipes only ``qpass study`` uses (operand-ablation controls); the shipped ``qpass/recipes`` hold the rest."""
