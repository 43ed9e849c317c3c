"""guard.step"""
