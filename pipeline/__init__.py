"""shoal.pipeline"""
