"""What kvcache asks of the machine it runs on: device identity (devices.py), the memory a device
has free and the check made before a cache is allocated (memory.py), and the intra-op thread rule
for a loaded model (threads.py). Nothing here imports the rest of kvcache."""
