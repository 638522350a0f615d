"""The cpu backend: worker processes decoding with libjpeg-turbo, and how batches come back."""
