"""The probe cache: answers stored under a key of everything that changes them, and when a hit still holds."""
