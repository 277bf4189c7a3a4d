"""streamrec.schemas"""
