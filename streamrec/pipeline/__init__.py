"""streamrec.pipeline"""
