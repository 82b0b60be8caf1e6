"""Quantized numbers, at the bottom of kvcache's imports: integer codes and their packing
(codes.py), and the packed views a quantized storage hands to attention (packed.py). Nothing
here imports the rest of kvcache."""
