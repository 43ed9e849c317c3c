"""guard.rollback"""
