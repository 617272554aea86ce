"""shoal.verification"""
