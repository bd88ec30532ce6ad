"""Operator-facing: the event sink, the view model it folds, the live dashboard, `dprun status`
and `dprun report`.
"""
