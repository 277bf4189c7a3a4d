"""streamrec.models"""
