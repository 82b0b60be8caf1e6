"""Quantized numbers, at the bottom of kvcache's imports: integer codes and their packing
(codes.py), the packed views a quantized storage hands to attention (packed.py), and linear
layers over 4-bit weights (int4_linear.py). Nothing here imports the rest of kvcache."""
