"""Outer methods that send fewer bits per round than dense DiLoCo (compressors.py), and their parts."""
